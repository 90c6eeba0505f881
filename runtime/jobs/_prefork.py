"""Imported last by a ``WorkerPool``'s fork server, after its preloads: ``gc.freeze()``.

Python's advice for a process that forks workers without exec: freeze what is loaded right
before forking.  The collector then never traverses torch's hundreds of thousands of objects
again, neither in the workers (each inherits the frozen set) nor when the server exits, where a
final collection over them costs about 0.3 CPU-s (the server outlives a one-shot ``meshc verify``
and holds its output pipes until then).
"""

import gc

gc.freeze()
