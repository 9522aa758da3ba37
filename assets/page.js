// The page's own scripts (this file and the others in assets/ named *.js), run in the browser: what Gradio 6.31's
// events leave undone on this page (the DOM they read is Gradio 6.31's, as tests/test_browser_*.py read it: elem_ids,
// the status tracker's Clear button, the editor's canvas and Brush button, the accordion's toggle, the client's POST
// to /gradio_api/upload). Each file is one function, read once at import (ui/blocks.py) and handed to an event's js=.
//
// Run once when the page loads (demo.load):
// - the red Error badge Gradio leaves on the image until its own Clear button is clicked goes at the user's next
//   action (typing, picking, clicking);
// - what the inpaint editor holds, as far as the page knows (window.neuronMask): 'empty' once an image came in by
//   Edit this image or a file, 'painted' after a brush stroke on its canvas, 'unknown' otherwise (a history pick may
//   restore a mask; the server checks every mask anyway); a file into the editor, or its Clear canvas button (named
//   in English), ticks or clears the hidden #editor-holds box, so the layout hint knows with no event on the editor;
// - a click on Inpaint with an empty mask is told at once beside the button and goes no further (nothing uploads:
//   it took 5 s behind the device's queue); any other click says, beside the button, how the upload of the editor's
//   files goes, file by file (seconds on a slow link, with nothing else moving), until inpaint.js runs;
// - a click on the grid's sheet opens its PNG full size in a new tab.
() => { if (window.neuronPage) return; window.neuronPage = true; window.neuronMask = 'unknown';
    const clearError = (event) => {
        const clear = document.querySelector('#image [data-testid="status-tracker"] .clear-status button');
        if (clear && !clear.contains(event.target)) clear.click(); };
    for (const type of ['input', 'pointerdown', 'keydown']) document.addEventListener(type, clearError, true);
    document.addEventListener('pointerdown', (event) => {
        const brush = document.querySelector('#inpaint-editor button[aria-label="Brush"]');
        if (event.target.tagName === 'CANVAS' && event.target.closest('#inpaint-editor')
            && brush?.classList.contains('highlight')) window.neuronMask = 'painted'; }, true);
    const holds = (held) => { const box = document.querySelector('#editor-holds input');
        if (box && box.checked !== held) box.click(); };
    document.addEventListener('change', (event) => {
        if (!event.target.closest?.('#inpaint-editor') || event.target.type !== 'file') return;
        window.neuronMask = 'empty'; holds(true); }, true);
    document.addEventListener('drop', (event) => {
        if (event.target.closest?.('#inpaint-editor')) { window.neuronMask = 'empty'; holds(true); } }, true);
    const say = (text) => { const button = document.querySelector('#inpaint');
        let note = document.getElementById('inpaint-note');
        if (!note) { note = document.createElement('p'); note.id = 'inpaint-note'; note.setAttribute('role', 'status');
                     button.insertAdjacentElement('afterend', note); }
        note.textContent = text; };
    const size = (bytes) => bytes < 1e6 ? `${Math.ceil(bytes / 1e3)} KB` : `${(bytes / 1e6).toFixed(1)} MB`;
    const tell = (up) => say(`Uploading the image and the painted mask: ${up.done} of ${up.files} files sent`
        + ` (${size(up.sent)} of ${size(up.bytes)})…`);
    document.addEventListener('click', (event) => {
        const sheet = event.target.closest?.('#grid-image .image-frame')?.querySelector('img');
        if (sheet) { window.open(sheet.src, '_blank', 'noopener'); event.preventDefault(); return; }
        if (event.target.closest?.('#history')) window.neuronMask = 'unknown';
        if (event.target.closest?.('#inpaint-editor button[aria-label="Clear canvas"]')) {
            window.neuronMask = 'unknown'; holds(false); }
        if (!event.target.closest?.('#inpaint')) return;
        if (window.neuronMask === 'empty') {
            say('The mask is empty: paint over the part to redo, then click Inpaint.');
            event.stopPropagation(); event.preventDefault(); return; }
        window.neuronUpload = {files: 0, done: 0, bytes: 0, sent: 0};
        say('Uploading the image and the painted mask…'); }, true);
    const send = window.fetch;
    window.fetch = (resource, init) => {
        const up = window.neuronUpload;
        if (!up || init?.method !== 'POST' || !/[/]gradio_api[/]upload([?]|$)/.test(String(resource?.url ?? resource)))
            return send(resource, init);
        const bytes = [...(init.body?.values?.() ?? [])].reduce((sum, file) => sum + (file.size ?? 0), 0);
        up.files += 1; up.bytes += bytes; tell(up);
        const failed = (why) => { if (window.neuronUpload !== up) return; window.neuronUpload = null;
            say(`The upload failed (${why}): nothing was sent.`); };
        return send(resource, init).then((response) => { up.done += 1; up.sent += bytes;
            if (!response.ok) failed(`HTTP ${response.status}`); else if (window.neuronUpload === up) tell(up);
            return response; }, (error) => { failed('the connection broke'); throw error; }); }; }
