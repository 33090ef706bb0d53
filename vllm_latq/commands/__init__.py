"""The console commands: latq-quantize, latq-inspect, latq-eval, latq-export, latq-serve and the demo."""
