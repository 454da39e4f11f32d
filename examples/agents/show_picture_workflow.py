"""The environment shows the policy a picture: a vision-language workflow.

A prompt asks the policy to wait for a picture; the row's label is a colour letter (r, g, b, y).
After the policy's first turn the environment draws a disc of that colour with PIL and shows it in
a user message (an image content part), then asks for the colour; the answer's turn is scored 1
when it names the colour. A tool that returns a PIL image is shown the same way (its tool
message carries the picture, then its text).

    torchrun ... -m lightrft.cli.train_ppo --pretrain <vision-language model> --image_key images \\
        --workflow examples/agents/show_picture_workflow.py --max_turns 2 --max_episode_tokens 64 \\
        --generate_max_len 2 ...

`--image_key` makes the run a vision-language one (rows without images are fine);
`--max_images_per_prompt` counts the prompt's pictures and the environment's together, and
`--max_episode_tokens` counts every picture's placeholder tokens.
"""

import random

from lightrft.agents import Workflow
from lightrft.datasets.toy_images import draw_disc


class ShowPicture(Workflow):
    async def run(self, episode) -> float:
        await episode.generate()
        # A picture of its own per episode: the prompt's row and sample pick the disc's place and size.
        picture = draw_disc(episode.label, random.Random(episode.index * 1009 + episode.sample))
        episode.add_messages({"role": "user", "content": [{"type": "image", "image": picture},
                                                          {"type": "text", "text": "Colour?"}]})
        answer = await episode.generate()
        return float(answer.text.strip() == episode.label)
