"""The planner: what a policy costs a fleet over a scenario of faults (model.py), run by
`lazarus simulate` over a scenario file or a preset (simulate.py, scenarios/)."""
