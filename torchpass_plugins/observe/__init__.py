"""What a run leaves to read: the event log, ``torchpass report``, Prometheus metrics, and the provenance
of published figures."""
