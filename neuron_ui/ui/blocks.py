"""The Gradio app: `build_demo(engine, settings)` lays out the blocks and wires the handlers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import gradio as gr

from neuron_ui.config.session_secret import load_session_secret
from neuron_ui.contract.requests import MAX_GUIDANCE, MAX_PROMPT_CHARS, MAX_SEED, MAX_STEPS
from neuron_ui.ui import session as sessions
from neuron_ui.ui.compare import CompareHandlers, add_ab_panel, add_compare_panel
from neuron_ui.ui.editing import EditingHandlers, add_inpaint_tab, add_reference_panel
from neuron_ui.web.files import ASSETS, build_image_store, page_script, private_file_folder
from neuron_ui.web.gradio_bridge import DEVICE, HIDDEN, TOLD, Listen, device_queue_length, serve_in_place
from neuron_ui.ui.handlers import MAX_VARIATIONS, Handlers
from neuron_ui.ui.named_api import add_named_api
from neuron_ui.ui.styles import StyleHandlers, add_style_controls, wire_style_controls
from neuron_ui.ui.words import (
    REFRESH_SECONDS,
    TABLE_HEADERS,
    TABLE_LEGEND,
    describe_activity,
    describe_engine,
    describe_now,
    describe_size,
    resolution_choices,
    status_rows,
    tiny_banner,
)

if TYPE_CHECKING:
    from neuron_ui.config.settings import Settings
    from neuron_ui.contract.engine_like import EngineLike
    from neuron_ui.contract.stopping import SessionStops


# The page's own scripts, run in the browser: each of assets/<name>.js says when it runs and why.
PAGE_SCRIPT, EDIT_SCRIPT, INPAINT_SCRIPT, SHOW_IMAGE = map(page_script, ["page", "edit", "inpaint", "show_image"])
PROMPTS = ASSETS / "prompts.txt"  # the examples under the form, one a line ("#" starts a comment)


def build_demo(engine: EngineLike, settings: Settings, stops: SessionStops | None = None) -> tuple[gr.Blocks, Handlers]:
    """The whole app around one engine, and the Handlers wired into it (their image store, status and tick, for the
    caller to keep); queue() and launch() are the caller's (app.py). `stops`, the registry of running requests by
    session, is the caller's to hand the server too (its gate stops a cancelled request)."""
    status = engine.status()
    # Gradio's queue is read at event time, from the demo built below (the closure binds `demo` late).
    store = build_image_store(settings.cache_dir)  # kept across restarts: the browsers' histories show them again
    serve_in_place(store.folder)
    handlers = Handlers(engine, store, waiting=lambda: device_queue_length(demo), uploads=private_file_folder(),
                        stops=stops, max_grid_cells=settings.max_grid_cells, max_grids=settings.max_queue + 1)
    serve_in_place(handlers.previews.folder)
    editing_handlers = EditingHandlers(engine, handlers.stored)
    first = str(engine.presets[0])
    # Every event that runs the pipeline: admitted up to --max-queue waiting plus the one on the device
    # (server.gate.Gate bounds it), each then waits in the engine's queue, where it hears what it waits for, can
    # be stopped, and the next image starts on the device while the previous one is encoded and sent.
    on_device: Listen = {"concurrency_id": DEVICE, "concurrency_limit": settings.max_queue + 1}
    private_on_device: Listen = {**on_device, "api_visibility": "private"}  # the page's own device events
    with gr.Blocks(title="neuron-ui · FLUX.2-klein", analytics_enabled=False) as demo:
        history, seen = gr.State([]), gr.State(None)
        # Rendered under the result; made first for the panels above it that add to the history.
        history_gallery = gr.Gallery(label="History: click an image to restore its settings", columns=6,
                                     fit_columns=False, height="auto", allow_preview=False, elem_id="history",
                                     render=False)
        # The form and history in the browser (a reload or a new tab finds them), with this session's id.
        session = gr.BrowserState({}, storage_key=sessions.STORAGE_KEY,
                                  secret=load_session_secret(settings.cache_dir, settings.session_secret))
        gr.Markdown(f"# neuron-ui · FLUX.2-klein\n{describe_engine(status, settings)}", elem_id="header")
        if status.is_tiny:
            gr.Markdown(tiny_banner(status), elem_id="tiny-banner")
        if status.cache_error:
            gr.Markdown("Compiled sizes will not survive a restart: the compile cache is not persistent here.",
                        elem_id="cache-warning")
        # On a phone (assets/style.css) #controls dissolves, so the image comes right after #form's button.
        with gr.Row(equal_height=False, elem_id="main-row"):
            with gr.Column(scale=2, min_width=340, elem_id="controls"):
                with gr.Column(elem_id="form"):
                    prompt = gr.Textbox(label="Prompt", placeholder="Describe the image, then press Enter", lines=1,
                                        max_lines=4, max_length=MAX_PROMPT_CHARS, elem_id="prompt", autofocus=True)
                    prompt_count = gr.Markdown(elem_id="prompt-count")
                    style, style_strength = add_style_controls(engine)
                    resolution = gr.Dropdown(resolution_choices(status), value=first, label="Resolution",
                                             elem_id="resolution")
                    hint = gr.Markdown(describe_size(status.shape(first)), elem_id="size-hint")
                    with gr.Row():
                        generate = gr.Button("Generate", variant="primary", elem_id="generate")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                        warmup = gr.Button("Warm up this size", elem_id="warmup")
                    now = gr.Markdown(describe_now(status, None), elem_id="device-now")
                with gr.Column(elem_id="form-more"):
                    with gr.Row(equal_height=False, elem_id="variations-row"):
                        count = gr.Radio(list(range(1, MAX_VARIATIONS + 1)), value=MAX_VARIATIONS, scale=2,
                                         label="Variations", info="same prompt, consecutive seeds", elem_id="count")
                        make_variations = gr.Button("Make variations", scale=1, elem_id="make-variations")
                    with gr.Accordion("Advanced", open=False, elem_id="advanced"):
                        steps = gr.Slider(1, MAX_STEPS, value=status.default_steps, step=1, label="Steps",
                                          info=f"the model's default is {status.default_steps}", elem_id="steps")
                        with gr.Row(equal_height=True):
                            # Gradio 6.31's page shows no value as 0 (Number: value ??= 0): never a placeholder
                            seed = gr.Number(None, label="Seed", precision=0, minimum=0, maximum=MAX_SEED, scale=2,
                                             info="typing one unticks Randomize", elem_id="seed")
                            with gr.Column(scale=1, min_width=120):
                                randomize = gr.Checkbox(True, label="Randomize", elem_id="randomize")
                                reuse = gr.Button("Reuse last seed", size="sm", elem_id="reuse-seed")
                        guidance = gr.Slider(0, MAX_GUIDANCE, value=status.default_guidance, step=0.1,
                                             label="Guidance", visible=not status.distilled, elem_id="guidance")
                    ref_files, ref_size, ref_fit = add_reference_panel(editing_handlers)
                    with gr.Accordion("Inpaint", open=False, elem_id="inpaint-panel"):
                        editor, editor_sent, holds, strength, inpaint = add_inpaint_tab()
                    compared, (grid_image, grid_line) = add_compare_panel(
                        CompareHandlers(handlers.studio, handlers.held, not handlers.distilled),
                        [loaded["name"] for loaded in status.styles], [prompt, resolution], history, history_gallery,
                        session, demo, private_on_device)
                    lines = PROMPTS.read_text(encoding="utf-8").splitlines() if PROMPTS.is_file() else []
                    examples = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
                    if examples:
                        gr.Examples([[text] for text in examples], inputs=[prompt], label="Example prompts")
            with gr.Column(scale=3, min_width=340, elem_id="result"):
                image = gr.Image(label="Image", type="filepath", format="png", interactive=False, height=440,
                                 buttons=["download", "fullscreen"], elem_id="image")
                info = gr.Markdown(elem_id="info")
                with gr.Row():  # under the result: take it into the next edit
                    use_result = gr.Button("Use as reference", size="sm", elem_id="use-as-reference")
                    edit_result = gr.Button("Edit this image", size="sm", elem_id="edit-image")
                add_ab_panel(image, history, history_gallery)
                layout_hint = gr.Markdown(elem_id="layout-hint")
                variations = gr.Gallery(label="Variations", columns=MAX_VARIATIONS, fit_columns=False, height="auto",
                                        visible=False, elem_id="variations")
                history_gallery.render()
        # The grid's sheet, full width so its labels can be read; shown (assets/style.css) once it holds a sheet, a
        # line or a grid's progress.
        with gr.Column(elem_id="grid-sheet"):
            grid_image.render()
            grid_line.render()
        with gr.Accordion("Sizes on this server", open=True, elem_id="status"):
            table = gr.Dataframe(status_rows(status), headers=TABLE_HEADERS, interactive=False, elem_id="status-table")
            gr.Markdown(TABLE_LEGEND, elem_id="table-legend")
            activity = gr.Markdown(describe_activity(status), elem_id="activity")
        timer = gr.Timer(REFRESH_SECONDS)

        refresh = (handlers.on_tick, [resolution, seen], [table, activity, resolution, hint, now, seen])
        form = [prompt, resolution, steps, seed, randomize, guidance]
        ref_inputs = [ref_files, ref_size, ref_fit]
        made = [image, info, seed, history, history_gallery]
        style_inputs = [style, style_strength]
        generated = gr.on([generate.click, prompt.submit], handlers.on_generate,
                          [*form, history, *ref_inputs, session, *style_inputs], made, show_progress_on=[image],
                          js=SHOW_IMAGE, **private_on_device)
        varied = make_variations.click(lambda: gr.Gallery(value=[], visible=True), None, variations, queue=False,
                                       js=SHOW_IMAGE, api_visibility="private").then(
            handlers.on_variations, [*form, count, history, session, *style_inputs],
            [image, info, seed, variations, history, history_gallery],
            show_progress_on=[image, variations], **private_on_device)
        warmup.click(handlers.on_warmup, [resolution, session], [hint], **private_on_device).then(*refresh, **HIDDEN)
        resolution.change(handlers.on_resolution, [resolution], [hint], **HIDDEN)
        seed.input(handlers.on_seed_typed, [seed], [randomize], **HIDDEN)
        prompt.change(handlers.on_prompt, [prompt], [prompt_count], trigger_mode="always_last", **HIDDEN)
        timer.tick(*refresh, **HIDDEN)
        # A reload or a new tab: the form, the history and any image finished meanwhile come back.
        collect = gr.Timer(REFRESH_SECONDS, active=False)
        demo.load(handlers.session.on_restore, [session],
                  [session, *form, history, history_gallery, image, info, collect], **HIDDEN).then(*refresh, **HIDDEN)
        demo.load(None, js=PAGE_SCRIPT)
        collect.tick(handlers.session.on_collect, [session, history], [*made, collect], **HIDDEN)
        changes = [prompt.change, resolution.change, steps.change, seed.change, randomize.change, guidance.change,
                   history.change]
        gr.on(changes, handlers.session.on_save, [session, *form, history], [session],
              trigger_mode="always_last", **HIDDEN)
        history_gallery.select(handlers.on_select, [history], [prompt, resolution, steps, seed, randomize, image, info,
                                                               *ref_inputs, editor, strength, holds],
                               show_progress_on=[image], **HIDDEN)
        wire_style_controls(StyleHandlers(engine), style, style_strength, history_gallery, history, demo)
        reuse.click(handlers.on_reuse_seed, [history, image], [seed, randomize], **TOLD)
        layout_inputs = [resolution, ref_files, ref_size, holds]
        gr.on([ref_files.change, ref_size.change, resolution.change, generate.click, holds.change, inpaint.click],
              editing_handlers.on_layout, layout_inputs, layout_hint, preprocess=False, **HIDDEN)
        use_result.click(editing_handlers.on_use_as_reference, [image, ref_files], ref_files, **TOLD)
        # No event shows progress on the editor or updates its panel: each uploads its files (editing.add_inpaint_tab).
        edit_result.click(editing_handlers.on_edit_image, [image], [editor, holds], js=EDIT_SCRIPT,
                          show_progress_on=[image], **TOLD)
        inpainted = inpaint.click(None, editor, editor_sent, js=INPAINT_SCRIPT, queue=False,
                                  api_visibility="private").success(
            handlers.on_inpaint,
            [editor_sent, prompt, resolution, strength, steps, seed, randomize, guidance, *ref_inputs, history, session,
             *style_inputs],
            made, show_progress_on=[image], **private_on_device,
            preprocess=False,  # the editor's files get the upload checks (Gradio's would decode them unbounded)
        )
        # Stop: the engine stops this session's image at the next step (cancels= alone leaves the thread running); a
        # notice says what Stop did, the line under the image the reason (on_failed).
        stop.click(handlers.on_stop, None, None, cancels=[generated, varied, inpainted, compared], **TOLD)
        # After a request: the status refreshes, a failure's line under the image says why (on_failed), and once the
        # request has ended the layout hint says the size's state now (it said "Compiling now" on a stop).
        for ended in (generated, varied, inpainted):
            ended.then(*refresh, **HIDDEN)
            ended.failure(handlers.on_failed, [session], [info], **HIDDEN)
            ended.then(handlers.on_settled, [session], None, **HIDDEN).then(
                editing_handlers.on_layout, layout_inputs, layout_hint, **HIDDEN)

        add_named_api(handlers.api, on_device)
    return demo, handlers
