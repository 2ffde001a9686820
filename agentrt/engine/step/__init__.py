"""What one engine step is made of, from scheduling to committed tokens: the scheduler and the
sequences it runs (scheduler.py, sequence.py), the step's rows and forward batch (step_rows.py,
step_tree.py for token trees), its one draft plan (draft_plan.py) with the drafter's side
(spec_runner.py, draft_runner.py), the budget completion and grammar constraints (budget.py,
constraints.py), and the sampler that says what each row emits (step_sampler.py). LLMEngine.step
(llm_engine.py) runs them in that order."""
