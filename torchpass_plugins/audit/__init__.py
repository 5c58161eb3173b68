"""``torchpass audit``: validate every node and link before a job lands on them (docs/audit.md)."""
