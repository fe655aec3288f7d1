"""What survives a restart: checkpoints and the rounds database (`store`), the state directory's
lock (`statelock`). May import `settings`.
"""
