// Run in the page before a request's handler (its inputs pass through): a phone scrolls the image, where the progress
// shows, into view; a wide page, where it is in view beside the button, does not move.
(...args) => { if (window.innerWidth <= 720)
    document.querySelector('#image')?.scrollIntoView({block: 'nearest', behavior: 'instant'}); return args; }
