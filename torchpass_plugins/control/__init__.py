"""The control plane: membership on the job's store, the per-node agent (``torchpass launch``), the
coordinator it hosts on node 0, and the worker's side of joining a job."""
