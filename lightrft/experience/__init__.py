"""Experience: what a PPO step trains on, and everything that makes it.

    samples          Experience, Sample (the sample format: per-token loss mask apart from the
                     attention layout), collate_samples, split_experience
    sources          ExperienceSource, ColocatedSource, PromptSampler, SourceContext, SourceBatch
    services         RolloutServices: the three services that make experience, chained
    generation       Generator, Generation (prompts -> samples or episodes; per-prompt seeds)
    builder          ExperienceBuilder (forwards, KL, advantages, which samples train)
    maker            NaiveExperienceMaker (the classic one-object front of the three services)
    scorer           Scorer, RewardBatch (every reward source, one report)
    recorded         RecordedSource, RecordedExperienceDataset (served traffic as experience)
    replay_buffer    NaiveReplayBuffer
    dynamic_sampling sample_informative_batch (DAPO's refill of all-equal groups)

Explorer ranks, which make rollouts elsewhere, are `lightrft.explorers`.
"""
