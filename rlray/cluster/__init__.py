"""The Ray edge: the actors each role runs in, starting them in placement groups, calls
with timeouts that name the actor, and the metrics exported to Ray."""
