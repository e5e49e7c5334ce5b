"""RAP preprocessing: op semantics (ops, reference), plans (plan), raw batches (batch), the exportable
PreprocessModule (module) and the Executor seam (executor). Import the submodule you need; this package
imports nothing heavy by itself."""
