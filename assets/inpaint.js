// Run in the page once Gradio has uploaded the editor's files for Inpaint (its value passes on, to the hidden editor
// the request reads): the upload's note goes, and the image, where the progress shows, scrolls into view on any width
// (Inpaint's button sits below the image's column on a wide page too).
(editor) => { window.neuronUpload = null;
    const note = document.getElementById('inpaint-note');
    if (note) note.textContent = '';
    document.querySelector('#image')?.scrollIntoView({block: 'nearest', behavior: 'instant'});
    return editor; }
