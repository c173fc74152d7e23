"""Checkpoints on the ranks, the same for every backend: ``saver`` (when a step saves, to which tier, background
writes, the one commit sequence), ``resume`` (which checkpoint a run continues from, verified and loaded),
``agree`` (every rank's share of the files recorded at save and verified at load), ``node_tier`` (the node-local
tier across nodes) and ``replica`` (its copy to the next node, in the background). The folders and the file checks
are ``hpc_tools.checkpoints``'; the engines only write their library's files
(``hpc_tools.train.engine.Checkpointable``). docs/checkpoints.md tells the whole story."""
