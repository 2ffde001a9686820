"""Errors a user can see. Each names the thing at fault."""


class AgentRTError(Exception):
    """Base class of every error agentrt raises on purpose."""


class ModelLoadError(AgentRTError):
    """A model could not be found, read or matched to our model code."""


class ModelNotInstalledError(ModelLoadError):
    """A known model whose package is not installed; the message says how to install it."""


class RequestError(AgentRTError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad sampling parameters)."""


class SpecConfigError(AgentRTError, ValueError):
    """A speculation input is invalid: an acceptance rate, a draft length, a cost model, a policy."""


class CalibrationError(AgentRTError):
    """Step-cost calibration could not produce a model (too few or unusable timings, bad cache file)."""


class SpecError(AgentRTError, ValueError):
    """Invalid input to speculative decoding: verification tensors, drafter calls, statistics."""


class ProgramValidationError(AgentRTError, ValueError):
    """A declared agent program is invalid. `problems` lists every (node, message) found; the
    message has one line per problem, each starting with the node id at fault and ending, where
    known, with the file:line that declared it (`sites`)."""

    def __init__(self, problems: list[tuple[str, str]], program: str = "", sites: dict[str, str] | None = None) -> None:
        self.problems = list(problems)
        self.program = program
        self.sites = dict(sites or {})
        lines = [f"{node}: {message}" + (f" (declared at {self.sites[node]})" if self.sites.get(node) else "")
                 for node, message in self.problems]
        if len(lines) > 1 and program:
            lines.append(f"({len(lines)} problems in program '{program}')")
        super().__init__("\n".join(lines))


class ProgramRunError(AgentRTError):
    """A program run ended, or was driven wrongly, because of one node; `node` names it."""

    def __init__(self, node: str, reason: str) -> None:
        self.node = node
        self.reason = reason
        super().__init__(f"{node}: {reason}")


class InputValueError(AgentRTError, ValueError):
    """A value given to a waiting wait_for node does not meet its schema; the run keeps waiting."""


class RunConfigError(AgentRTError, ValueError):
    """A program cannot be run as configured: a tool it declares has no implementation, an input
    value does not parse as its declared type, an example file lacks `program`, a bad trace file."""
