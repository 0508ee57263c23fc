"""The simulated backend: the local one with every node's launcher and ranks replaced by the records
they would write, for sizes and fleets this machine cannot run."""
