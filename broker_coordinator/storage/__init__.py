"""What survives a restart: the current task's checkpoints and rounds (`store`), the tasks before it
(`tasks`), backups of all of it (`backup`, `restore`), the state directory's lock (`statelock`).
May import `settings`.
"""
