"""`meshc verify`: a plan's tiny twin run sharded and unsharded, compared."""
