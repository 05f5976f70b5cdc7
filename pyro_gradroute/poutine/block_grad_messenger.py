"""block_grad handler (issue 3). Placeholder collector: no routes yet."""


def collect_blocks(model_trace, guide_trace) -> dict:
    return {}
