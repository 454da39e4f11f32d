"""Higher or lower: the policy guesses a hidden digit, the environment answers each guess.

A prompt names a range, "3-8"; the row's label is the hidden digit in it. Each turn the policy
answers with one digit; a right guess wins (reward 1), a wrong one is answered "higher" or
"lower" as a user message, and the policy guesses again. `--max_turns` is the number of guesses:
out of guesses, the game is lost (reward 0). Bisection wins every range of up to 7 digits in 3
guesses; guessing at random among the digits still possible wins about 3 games in 4.

A guess that the answers so far already rule out (or that is not a digit) gets a per-turn
penalty (`episode.reward_turn`): it wastes a guess whatever the hidden digit is, so it is a
lesson every game teaches. The episode's reward, and what evaluation reports, is the win alone.

    torchrun ... -m lightrft.cli.train_ppo --workflow examples/agents/guessing_game_workflow.py \
        --apply_chat_template --max_turns 3 --max_episode_tokens 96 --generate_max_len 2 ...
"""

import re

from lightrft.agents import Workflow

WASTED_GUESS = -0.5


def feedback(guess: str, secret: int) -> str:
    """The environment's answer to a wrong guess."""
    if not guess.isdigit():
        return "one digit"
    return "higher" if secret > int(guess) else "lower"


class GuessingGame(Workflow):
    async def run(self, episode) -> float:
        secret = int(episode.label)
        # The prompt is the range, through the chat template with --apply_chat_template.
        lo, hi = (int(x) for x in re.search(r"(\d+)-(\d+)", episode.prompt).groups())
        while episode.turns_left > 0:
            guess = (await episode.generate()).text.strip()
            if guess == str(secret):
                return 1.0
            if not (guess.isdigit() and lo <= int(guess) <= hi):
                episode.reward_turn(WASTED_GUESS)
            elif int(guess) < secret:
                lo = int(guess) + 1
            else:
                hi = int(guess) - 1
            if episode.turns_left > 0:
                episode.add_messages({"role": "user", "content": feedback(guess, secret)})
        return 0.0
