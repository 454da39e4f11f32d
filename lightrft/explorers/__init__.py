"""Explorer ranks (`train_ppo --explorer_ranks N`, or `--sync_offset D` on a thread): rollouts
made apart from the trainers, with bounded staleness (docs/async.md).

    link       ExplorerLink: the trainers' end, their ExperienceSource; trainer_link,
               start_ahead_explorer
    explorer   Explorer (the explorers' loop), ExplorerParts (what it runs with, built by
               lightrft.builders.explorers), run_explorer
    batches    RolloutBatch, ExperienceReceiver (explorers -> trainers)
    weights    WeightPublisher, WeightSubscriber, latest_published (trainers -> explorers)
    ledger     PromptLedger (every prompt's fate, in every checkpoint)
    roles      join_roles, the channels and the plain-data wire format
"""
