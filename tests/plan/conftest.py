import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="module")
def pg():
    from genome_lm.engine.parallel import parallel_context

    with parallel_context() as groups:
        yield groups
