"""The virtual fleet: the real router and simulated workers in one process on a virtual clock, and the floor."""
