"""The vocabulary of distribution that the checker, the planner and lowering share: mesh roles,
DTensor placements, activation layouts, collectives and device profiles. Imports no layer kind."""
