"""Engine memory regions on the daemon's side and the copy executor that serves them: `service` registers
regions and answers store_pages / load_pages, `copier` moves bytes between host regions and L2 on
threads, `cuda` does it for CUDA regions on a stream per device, `jobs` is what both run."""
