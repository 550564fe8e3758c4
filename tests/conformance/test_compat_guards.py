"""Guards of the conformance workarounds in `tfmulti.compat`: each asserts
the stock TensorFlow / Keras behaviour still fails, so it fails once an
upstream release fixes it (then delete the workaround and its guard)."""

import pytest

from tests.conformance.conftest import error_of

pytestmark = pytest.mark.timeout(900)


@pytest.mark.slow
def test_stock_mirrored_tutorial_still_fails(local):
    # compat.bind_collective_keys_at_trace_time
    text = error_of(local["guards"]["lazy_optimizer"])
    assert "You must feed a value for placeholder tensor" in text


@pytest.mark.slow
def test_keras_still_reduces_the_first_batch(local):
    # compat.KerasMirroredStrategy.reduce
    text = error_of(local["guards"]["first_batch_build"])
    assert "must have the same size and shape" in text
