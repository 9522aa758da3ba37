"""The page's own scripts, run in the browser: what Gradio 6.31's events leave undone on this page (the DOM they
read is Gradio 6.31's, as tests/test_browser_*.py read it: elem_ids, the status tracker's Clear button)."""

# Run once when the page loads (demo.load): the red Error badge Gradio leaves on the image until its own Clear button
# is clicked goes at the user's next action (typing, picking, clicking); and a click on Inpaint says, beside the
# button, what the browser uploads before the request leaves (the editor's image and painted mask: seconds on a slow
# link, with nothing else moving).
PAGE_SCRIPT = """() => { if (window.neuronPage) return; window.neuronPage = true;
    const clearError = (event) => {
        const clear = document.querySelector('#image [data-testid="status-tracker"] .clear-status button');
        if (clear && !clear.contains(event.target)) clear.click(); };
    for (const type of ['input', 'pointerdown', 'keydown']) document.addEventListener(type, clearError, true);
    document.addEventListener('click', (event) => {
        if (!event.target.closest?.('#inpaint')) return;
        const button = document.querySelector('#inpaint');
        let note = document.getElementById('inpaint-note');
        if (!note) { note = document.createElement('p'); note.id = 'inpaint-note'; note.setAttribute('role', 'status');
                     button.insertAdjacentElement('afterend', note); }
        note.textContent = 'Uploading the image and the painted mask…'; }, true); }"""

# Run in the page before Inpaint's request, once the editor's files are uploaded (its inputs pass through): an empty
# mask is told at once beside the button, and the request does not leave (the server's check stays as the guard; it
# took 5 s behind the device's queue). Otherwise the image, where the progress shows, scrolls into view on any width:
# Inpaint's button sits below the image's column on a wide page too.
INPAINT_SCRIPT = """(...args) => { const note = document.getElementById('inpaint-note');
    const editor = args[0];
    window.neuronMaskEmpty = Boolean(editor?.background && !editor.layers?.length);
    if (window.neuronMaskEmpty) {
        if (note) note.textContent = 'The mask is empty: paint over the part to redo, then click Inpaint.';
        throw new Error('the mask is empty'); }
    if (note) note.textContent = '';
    document.querySelector('#image')?.scrollIntoView({block: 'nearest', behavior: 'instant'});
    return args; }"""

# Run in the page before Inpaint's failure handler (the line under the image): when the page refused an empty mask,
# the words beside the button say it all and the line keeps what it said ("Not made: The message says why" named no
# message); throwing skips the handler's request. Any other failure goes on to the server's reason.
INPAINT_FAILED_SCRIPT = """(...args) => { if (window.neuronMaskEmpty) throw new Error('refused in the page');
    return args; }"""
