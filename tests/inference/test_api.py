import math

import pytest

from k3.inference.api import SamplingParams


@pytest.mark.parametrize("field,value", [("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan),
                                         ("temperature", -0.5), ("max_tokens", 0), ("top_k", -1), ("logprobs", 6)])
def test_sampling_params_refuse_nan_inf_and_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept_their_range():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=1, logprobs=5)
