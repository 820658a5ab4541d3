"""Test and benchmark support that does not ship in the collector's runtime path: seeded synthetic
runs (scenarios) for the detector evaluation, the replay tests and the benchmarks."""
