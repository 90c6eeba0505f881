"""Running many small distributed jobs on a pool of gloo workers, and comparing with the reference."""
