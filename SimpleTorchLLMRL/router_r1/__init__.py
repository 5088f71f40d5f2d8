"""The seed's import path for the Router-R1 recipe: `SimpleTorchLLMRL.router_r1` *is*
`SimpleTorchLLMRL.recipes.router_r1`.

The recipe lives in recipes/ (built only from the library's public parts); this package holds no code
of its own. Importing it puts the recipe's package and each of its modules under this name as well, so
`SimpleTorchLLMRL.router_r1.config.RouterDataConfig` and the recipe's class are one object, never a copy.
"""

import sys

import SimpleTorchLLMRL.recipes.router_r1 as _recipe
from SimpleTorchLLMRL.recipes.router_r1 import config, data, generation, pool, reward, tags, trainer

for _module in (config, data, generation, pool, reward, tags, trainer):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
sys.modules[__name__] = _recipe
