"""The recovery engine, independent of any training framework: positions and collectives with recovery
(``runtime``), the decisions every member derives from the same rows (``replicated_recovery``,
``sharded_recovery``), the reconfigurable process group and its backends, and the state it moves
(``state_transfer``, ``ring_replication``, ``rank_state``)."""
