"""Training a plan: stage modules from the partition, and a pipeline that trains them."""
