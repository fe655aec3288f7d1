import sys

from broker_coordinator.cli.cli import main

sys.exit(main())
