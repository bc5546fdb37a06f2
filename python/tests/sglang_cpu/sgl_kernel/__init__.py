"""Import-only stand-in for SGLang's CPU build of ``sgl_kernel``, which is not on PyPI.

SGLang's CPU engine imports names from it at module load; with ``--attention-backend torch_native``
and a Qwen2 model none of them is called. Every name resolves to a function that raises, so a call
that does reach it fails loudly instead of computing something else."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: this is an import-only stand-in")

    missing.__name__ = name
    return missing
