// Run in the page on Edit this image's click (its input passes through): the shown result comes into the editor with
// nothing painted, and the Inpaint panel opens here, not by the server's update: an update to the panel makes Gradio
// 6.31 read, and so upload, every component inside it (core's update_state: get_data on the node and its children).
(...args) => { if (!document.querySelector('#image img')) return args;  // the server says why
    window.neuronMask = 'empty';
    const toggle = document.querySelector('#inpaint-panel button.label-wrap');
    if (toggle && !toggle.classList.contains('open')) toggle.click();
    return args; }
