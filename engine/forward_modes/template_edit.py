"""InstGenIE's edits of templates with cached activations (`engine.template_edits`): an edit of
a template gets the template's record at admission, or records one; a group of such edits runs
masked when each has its record (the slots the worker's loading DP picks loaded, counted in
`tally` for the plan's report), else exact and recording. Approximate (`edit_cache.enabled`)."""

from __future__ import annotations

import torch

from stepserve.engine.editing.block_loader import pin
from stepserve.engine.editing.loading_plan import BlockTally
from stepserve.engine.editing.masked_sd3 import token_index
from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.engine.template_edits import EditMember, TemplateCache, TemplateEdit, template_forward, template_key


class TemplateEdits(ForwardMode):
    name = ModeName.TEMPLATE_EDIT

    def __init__(self, templates: TemplateCache):
        self.templates = templates
        self.tally = BlockTally()

    def admit(self, sampler, family) -> None:
        """Its `TemplateEdit`: the template's record if the store has one (pinned for
        asynchronous copies where the family runs on CUDA: once per edit), else it records one."""
        spec = sampler.spec
        if spec.template_id is None:
            return
        key = template_key(spec, self.templates.kind)
        mask = sampler.edit.mask.expand(spec.rows, -1, -1, -1)
        record = self.templates.source.get(key)
        if record is not None and family.device.type == "cuda":
            record = pin(record)
        sampler.enter(self.name, TemplateEdit(key, self.templates.kind, token_index(mask, family.patch_size), record))

    def takes(self, batch: ForwardBatch) -> bool:
        return not batch.group.ranks and not batch.addons and batch.all_in(self.name)

    def forward(self, batch: ForwardBatch) -> list[torch.Tensor]:
        members = [EditMember(s.mode_state, s.rows, s.step_index) for s in batch.samplers]
        return batch.split(template_forward(batch.family, members, *batch.joined(), self.templates.planner,
                                            self.tally))

    def missed(self, sampler) -> None:
        sampler.leave()  # a record missing this step would be no record

    def stepped(self, sampler) -> None:
        """A recording edit's whole record (every step, every block) goes to the store once it is done."""
        edit: TemplateEdit = sampler.mode_state
        if edit.records and sampler.done:
            self.templates.source.put(edit.key, edit.recorded)
