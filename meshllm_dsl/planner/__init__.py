"""The static planner: memory, communication, schedule and step time of a checked plan (`meshc plan`,
`meshc suggest`, `meshc calibrate`)."""
