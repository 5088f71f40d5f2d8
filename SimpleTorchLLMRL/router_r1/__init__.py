"""router_r1."""
