"""Experience: what a PPO step trains on, and everything that makes it.

    samples          Experience, Sample (the sample format: per-token loss mask apart from the
                     attention layout), collate_samples, split_experience
    sources          ExperienceSource, ColocatedSource, PromptSampler, SourceContext, SourceBatch
    maker            NaiveExperienceMaker (generate + score + build), ExperienceBuilder (forwards,
                     KL, advantages)
    scorer           Scorer, RewardBatch (every reward source, one report)
    recorded         RecordedSource, RecordedExperienceDataset (served traffic as experience)
    replay_buffer    NaiveReplayBuffer
    dynamic_sampling sample_informative_batch (DAPO's refill of all-equal groups)

Explorer ranks, which make rollouts elsewhere, are `lightrft.explorers`.
"""
