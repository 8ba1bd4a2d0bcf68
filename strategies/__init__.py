"""Algorithm registry: name -> Algorithm (server half + client half, one module each).

Adding an algorithm: write ``strategies/<name>.py`` defining ``ALGORITHM`` and add one
line below.
"""

from strategies import fedavg, fedper, fedprox, fedrep, lg_fedavg, local_only, local_update, scaffold, tct
from strategies.base import Algorithm

ALGORITHMS: dict[str, Algorithm] = {
    fedavg.ALGORITHM.name: fedavg.ALGORITHM,
    fedprox.ALGORITHM.name: fedprox.ALGORITHM,
    local_only.ALGORITHM.name: local_only.ALGORITHM,
    fedrep.ALGORITHM.name: fedrep.ALGORITHM,
    fedper.ALGORITHM.name: fedper.ALGORITHM,
    lg_fedavg.ALGORITHM.name: lg_fedavg.ALGORITHM,
    scaffold.ALGORITHM.name: scaffold.ALGORITHM,
    tct.ALGORITHM.name: tct.ALGORITHM,
    local_update.ALGORITHM.name: local_update.ALGORITHM,
}
