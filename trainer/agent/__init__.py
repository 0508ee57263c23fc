"""The node agent: a node's launcher (its ranks' environment, output, idleness, node reports, stacks,
health checks, teardown) and its warm standby."""
