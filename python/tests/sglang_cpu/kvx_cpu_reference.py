"""An SGLang plugin for the reference pair on CPU (SGLang's own ``mooncake_tcp`` backend): its
sender's host-tensor index path pins host memory through CUDA, so it is switched off here, and
SGLang takes the plain index path it uses for every other backend."""


def install() -> None:
    try:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    except ImportError:  # mooncake is not installed in this process: nothing to patch
        return
    MooncakeKVSender.supports_host_tensor_indices = False
