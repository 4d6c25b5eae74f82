"""What ``miles train`` does on the launching host, apart from the trainer ranks' loop (:mod:`miles.driver`):
start the engines, the router and the trainer ranks through the launcher and supervise them
(:mod:`~miles.host.train`), show progress (:mod:`~miles.host.progress`), keep the run directory
(:mod:`~miles.host.rundir`), and ``--debug``, the whole run in this one process (:mod:`~miles.host.debug`)."""
