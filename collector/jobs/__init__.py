"""Jobs: the job map built from rank reports, the policy's view of it, goodput accounting."""
