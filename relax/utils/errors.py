"""Errors shared across layers."""


class RunFault(RuntimeError):
    """A process the run depends on died or hung (a role's Ray process, TransferQueue's actors, a role that stopped
    sending heartbeats). The run ends with the message alone, which names the process, and exit status 1, so
    ``--max-global-restart`` restarts it from its last checkpoint: the fault is in the machine, not the settings."""
