"""What people read: round lines, history and plots (`report`), Prometheus (`metrics`), the
devices' federated score (`evaluation`). May import `settings`.
"""
