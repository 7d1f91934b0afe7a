"""ep_plugin: expert-parallel token dispatch and combine for MoE training (Megatron-Core plugin).

    import ep_plugin
    backend = ep_plugin.get_backend("reference")(group, hidden_size=H, num_experts=E)
    out = ep_plugin.dispatch(backend, hidden, routing_map=routing_map, probs=probs)
    y = ep_plugin.combine(expert_fn(out.hidden, out.probs, out.tokens_per_expert), out.handle)
"""

from .autograd import combine, dispatch
from .config import Config
from .errors import BackendUnavailableError, EPError, EPTimeoutError, TooManyTokensError
from .handle import CombineOutput, DispatchOutput, Handle
from .registry import get_backend, list_backends, register_backend
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError", "CombineOutput", "Config", "DispatchOutput", "EPError", "EPTimeoutError", "Handle",
    "TooManyTokensError", "Topology", "combine", "dispatch", "get_backend", "list_backends", "register_backend",
]
