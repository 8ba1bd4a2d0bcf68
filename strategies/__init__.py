"""Algorithm registry: name -> Algorithm (server half + client half, one module each).

Adding an algorithm: write ``strategies/<name>.py`` ending in ``ALGORITHM = register(Algorithm(...))``
and import it on the line below (or call :func:`~strategies.base.register` from your own code).
"""

from strategies import apfl, ditto, fed_mtl, fedala, fedamp, fedavg, fedbabu, fedbn, feddbe, fedper, fedproto, fedprox, fedrep, fedrod, l2gd, lg_fedavg, local_from_average, local_only, local_update, perfedavg, pfedme, scaffold, tct  # noqa: F401
from strategies.base import ALGORITHMS, Algorithm, register

__all__ = ["ALGORITHMS", "Algorithm", "register"]
