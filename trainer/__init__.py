"""The ROLL-style RL trainer for language-model agents (single controller over Ray worker
clusters, AutoDeviceMapping, parallel strategies, vLLM rollouts). Being built; the package
exists so the layout and the distribution are fixed from the start."""
