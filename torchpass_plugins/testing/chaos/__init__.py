"""The chaos matrix: seeded scenarios of faults in every phase, each run as a real job and classified."""
