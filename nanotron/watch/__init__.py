"""Never blind on a cluster: each rank says where it is (`heartbeat`), a watcher process per node notices when a
rank stops moving (`watcher`), names the culprit from every rank's phase, stacks and flight-recorder sequence
numbers (`attribution`), and ends the job with an exit code that says what to do next. `straggler` scores how
much longer each rank works between collectives than its peers; `faults` injects faults for tests and drills.

The trainer loads `heartbeat`, `faults`, `straggler` and `suspects` only; the watcher is started by
`nanotron.launch.torchrun`. `suspects` alone reads and writes the run dir's `suspect_nodes.txt`.
"""
