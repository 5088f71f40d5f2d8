"""What the tests share besides fixtures: helpers, fakes, real data loaders and the two stages' hooks."""
