"""SGLang workers for the router: an SGLang-faithful simulated worker, and launch help for real SGLang."""
